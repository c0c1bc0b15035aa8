"""The documents stay true and short, and the code carries no measurements.

Every relative link in README.md, ARCHITECTURE.md, docs/*.md and bench/README.md names a file that exists
(and a heading that exists, where it points into a markdown file with ``#anchor``); every raw result under
bench/results/ is cited by a document; the README reads in five minutes; ARCHITECTURE.md names every engine
file; and no line under tplab/ names a
CPU or GPU model, a calendar date or a rate: measurements live in docs/performance.md, beside their machine.
Each checker is also run on a string that breaks it, so that a checker which can never fail is caught.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "ARCHITECTURE.md", "bench/README.md",
        *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text with code blocks and code spans blanked (their brackets are not links); lines kept."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)            # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen, out = {}, set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def links(path: Path, text: str) -> list[tuple[int, str]]:
    """(line number, target) of every relative link in a markdown text."""
    found = []
    for n, line in enumerate(_prose(text).splitlines(), 1):
        for target in LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):              # http:, https:, mailto:
                found.append((n, target))
    return found


def broken_links(path: Path, text: str) -> list[str]:
    """``file:line: target (why)`` for each relative link of ``text`` (the file at ``path``) that does not
    resolve: a missing file or folder, or a ``#anchor`` no heading of the markdown file it names makes."""
    bad = []
    for n, target in links(path, text):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}: {target}"
        if file_part and not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md":
            if anchor not in anchors(dest.read_text() if file_part else text):
                bad.append(f"{where} (no heading '#{anchor}' in {dest.name})")
    return bad


def test_every_relative_link_in_the_documents_resolves():
    bad = [b for doc in DOCS if (ROOT / doc).exists() for b in broken_links(ROOT / doc, (ROOT / doc).read_text())]
    assert not bad, "links that do not resolve:\n  " + "\n  ".join(bad)


def test_the_link_checker_can_fail(tmp_path):
    (tmp_path / "there.md").write_text("# A heading: `here`\n")
    text = ("[ok](there.md) [ok](there.md#a-heading-here) [web](https://example.com) `[code](nowhere.md)`\n"
            "[missing](nowhere.md)\n[bad anchor](there.md#not-a-heading)\n[self](#nope)\n")
    bad = broken_links(tmp_path / "doc.md", text)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "nowhere.md (no such file)", "there.md#not-a-heading (no heading '#not-a-heading' in there.md)",
        "#nope (no heading '#nope' in doc.md)"], bad


def test_every_result_file_is_cited_by_a_document():
    cited = set()
    for doc in DOCS:
        path = ROOT / doc
        if path.exists():
            text = path.read_text()
            cited |= {(path.parent / t.partition("#")[0]).resolve() for _, t in links(path, text)}
            cited |= {(ROOT / m).resolve() for m in re.findall(r"bench/results/[\w./-]+", text)}
    under = ROOT / "bench" / "results"           # results/quick/ holds --quick runs, ignored by git
    results = sorted(p for p in under.rglob("*")
                     if p.is_file() and p.suffix != ".tmp" and p.relative_to(under).parts[0] != "quick")
    uncited = [p.relative_to(ROOT).as_posix() for p in results if p.resolve() not in cited]
    assert not uncited, "result files no document cites (cite them in docs/performance.md or its journal, " \
                        "or git rm them):\n  " + "\n  ".join(uncited)


def test_the_readme_reads_in_five_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}: " \
                                           "move the detail to docs/"
    text = "\n".join(lines)
    assert "seeds" not in text and "../shared" not in text


def unmapped(architecture: str, modules: list[Path]) -> list[str]:
    """The engine modules (``tplab/<room>/<file>.py``) that ARCHITECTURE.md's text never names."""
    return [p.relative_to(ROOT).as_posix() for p in modules if p.name != "__init__.py" and p.name not in architecture]


def test_the_architecture_maps_every_engine_file():
    """The README says ARCHITECTURE.md maps every file: each engine module is named there (the teaching side by
    its folders)."""
    modules = sorted(p for room in ("distributed", "layers", "kernels", "models", "engine")
                     for p in (ROOT / "tplab" / room).glob("*.py"))
    missing = unmapped((ROOT / "ARCHITECTURE.md").read_text(), modules)
    assert not missing, f"engine files ARCHITECTURE.md does not name (say what each is for): {missing}"
    assert unmapped("`linear.py`", [ROOT / "tplab/layers/linear.py", ROOT / "tplab/layers/weights.py"]) == \
        ["tplab/layers/weights.py"]                                             # the check can fail


# A CPU or GPU model, a calendar date, a rate: what a measurement names, and the code must not.
MEASUREMENT = re.compile(
    r"\b(xeon|epyc|ryzen|threadripper|opteron|zen ?[1-6]\b|(sapphire|emerald|granite) rapids|ice lake|cascade lake"
    r"|skylake|genoa|gh200|[hbav]100|h200|b200|l40s?|rtx ?\d{3,4}|geforce|apple m[1-4]\b)"
    r"|\b20\d\d-[01]\d-[0-3]\d\b"
    r"|(?<![a-z])(tok/s|tokens?/s(ec)?\b|tokens per second|[kmgt]i?b/s\b)",
    re.I)


def measurements(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line that names a machine, a date or a rate."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if MEASUREMENT.search(line)]


def test_the_code_carries_no_measurements():
    bad = [f"{p.relative_to(ROOT)}:{n}: {line}" for p in sorted((ROOT / "tplab").rglob("*.py"))
           for n, line in measurements(p.read_text())]
    assert not bad, ("lines under tplab/ that name a machine, a date or a rate (move the figure to "
                     "docs/performance.md or its journal; a line may point there):\n  " + "\n  ".join(bad))


def test_the_measurement_checker_can_fail():
    text = ("x = 1  # fine: 1024 eps, 2 cores, 4 KiB pages, AMX, AVX-512, Intel's MKL\n"
            "# 1.25x faster on an AMD EPYC\n# measured 2026-11-27\n# 13.3 tok/s\n# streams 18 GB/s\n"
            "# Zen 3 and Zen4\n# an NVIDIA H200\n# RTX 4090\n# Sapphire Rapids\n")
    assert [n for n, _ in measurements(text)] == [2, 3, 4, 5, 6, 7, 8, 9]
