"""How the engine's layers are made fast on one machine or another: the kernels a layer or an attention is
handed (``Parts.gemm``, ``Parts.attend``, ``Parts.attention``). The layers (``tplab.layers``) hold the idea and
never import this room; this room may import them."""
