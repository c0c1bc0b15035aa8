"""The teaching side: what the notebooks use on top of the engine. The engine never imports it.

``bugs``       the pitfalls of a student's TP implementation, as drop-in parts (``LLM(bugs=[...])``)
``golden``     HF's own activations by hooks, per-sublayer diffs, a cmp-style report
``exercises``  the learner's exercises and their checkers, ``check_part`` for whole parts
``workbook``   the model every notebook runs, a seeded setup, the ledger of checks
``plotting``   the small figures the notebooks share; ``interact`` for widgets that keep a picture
"""
