"""The README's and the guides' Python examples run as written, each in a new process, one after another in one
folder per document (a later example may load what an earlier one saved), and print what the document says they
print: every block is followed by `<!-- prints: REGEX -->`. A guide's block without that line is only compiled.
The README's shell commands run too, after its examples, with small settings (SMALL below). One test per document,
so a document's steps stay in order in one process under `pytest -n`."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = ["docs/your-model-and-data.md", "docs/methods.md", "docs/benchmarks.md", "docs/serving.md",
          "docs/multi-gpu.md", "docs/reproducing.md"]
BLOCK = re.compile(r"```python\n(.*?)```\n(?:<!-- prints: (.*?) -->)?", re.S)
EXAMPLES = [(doc, code, expected) for doc in ["README.md", *GUIDES]
            for code, expected in BLOCK.findall((ROOT / doc).read_text())]
RUN = [e for e in EXAMPLES if e[2]]


def test_readme_has_examples_with_expected_output():
    readme = [e for e in EXAMPLES if e[0] == "README.md"]
    assert len(readme) >= 2 and all(expected for _, _, expected in readme)
    assert len(RUN) >= 9  # the guides' examples run too


@pytest.mark.parametrize("doc", list(dict.fromkeys(d for d, _, _ in RUN)), ids=lambda d: Path(d).stem)
def test_python_examples_run_in_order(doc, tmp_path):
    """A document's examples in its order, in one folder; the README's commands after them (adapt reads the files
    the first example wrote)."""
    for i, (_, code, expected) in enumerate(e for e in RUN if e[0] == doc):
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, f"{doc} example {i}: " + run.stderr[-2000:]
        assert re.search(expected, run.stdout, re.M), f"{doc} example {i}: " + run.stdout
    if doc == "README.md":
        for command in [c for c in commands(doc) if c.startswith("forgetless")]:
            readme_command_runs(command, tmp_path)


@pytest.mark.parametrize("doc,code", [(d, c) for d, c, e in EXAMPLES if not e])
def test_python_snippet_without_output_compiles(doc, code):
    compile(code, doc, "exec")
    for name in re.findall(r"forgetless\.(\w+(?:\.\w+)?)", code):  # the API it names exists
        import forgetless
        obj = forgetless
        for part in name.split("."):
            obj = getattr(obj, part)


# ---- shell commands -------------------------------------------------------------------------
def commands(doc: str) -> list[str]:
    """The commands of a document's ```bash blocks: continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


# README commands -> the arguments added to run them small (seconds, or a few SmolLM2 steps)
SMALL = {
    "forgetless bench": ["--preset", "smoke", "--seeds", "1", "--methods", "full,lora", "--out", "bench-small"],
    "forgetless adapt": ["--preset", "smoke", "--max-length", "32", "--adapt-steps", "2", "--adapt-batch-size", "2"],
}


def test_readme_commands_have_small_settings_or_are_setup():
    for command in commands("README.md"):
        if command.startswith("bash scripts/setup.sh"):
            assert subprocess.run(["bash", "-n", ROOT / "scripts/setup.sh"]).returncode == 0
            usage = (ROOT / "scripts/setup.sh").read_text()
            for extra in shlex.split(command)[2:]:
                assert re.search(rf"\b{extra}\b.*\)", usage), f"setup.sh does not take {extra}"
        else:
            assert " ".join(shlex.split(command)[:2]) in SMALL, f"no small settings for README command {command!r}"


def readme_command_runs(command: str, folder: Path):
    """A README command with its small settings, in the folder of the README's examples."""
    args = shlex.split(command)
    run = subprocess.run([sys.executable, "-m", "forgetless", *args[1:], *SMALL[" ".join(args[:2])]], cwd=folder,
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, command + ": " + (run.stdout + run.stderr)[-3000:]
    if args[1] == "adapt":
        out = folder / args[args.index("--out") + 1]
        assert (out / "report.md").is_file() and (out / "model" / "config.json").is_file()


def forgetless_calls(doc: str) -> list[list[str]]:
    """Every `forgetless ...` call of a document (also under torchrun / accelerate `-m forgetless`), as its
    arguments after `forgetless`."""
    calls = []
    for command in commands(doc):
        args = shlex.split(command.replace(" &", ""))
        if args[0] == "forgetless":
            calls.append(args[1:])
        elif "-m" in args and args[args.index("-m") + 1] == "forgetless":
            calls.append(args[args.index("-m") + 2:])
    return calls


def help_text(words: list[str]) -> str:
    from typer.testing import CliRunner

    from forgetless.cli import app
    result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "300", "TERMINAL_WIDTH": "300"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("doc", ["README.md", *GUIDES])
def test_every_command_and_flag_a_doc_names_exists(doc):
    """Each `forgetless` command and --flag of a doc's shell blocks is in that command's --help; each
    `bash scripts/X.sh` exists and parses."""
    for args in forgetless_calls(doc):
        words = [a for a in args[:2] if not a.startswith("-")][:2]
        if len(words) == 2 and f"{words[1]} " not in help_text(words[:1]).replace("│", " "):
            words = words[:1]  # the second word is an argument (`forgetless export RUN`), not a subcommand
        text = help_text(words)
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert flag in text, f"{doc}: `forgetless {' '.join(words)}` has no {flag}"
    for command in commands(doc):
        if command.startswith("bash scripts/"):
            script = ROOT / shlex.split(command)[1]
            assert script.is_file() and subprocess.run(["bash", "-n", script]).returncode == 0, command


def test_reproduce_sections_named_in_the_guide_exist():
    listed = subprocess.run(["bash", ROOT / "scripts/reproduce.sh", "list"], capture_output=True, text=True,
                            check=True).stdout.split()
    named = re.findall(r"`([a-z0-9]+(?:-[a-z0-9*]+)+|[a-z]+)`", (ROOT / "docs/reproducing.md").read_text()
                       .split("| sections |")[1].split("\n\n")[0])
    assert named
    for name in named:
        pattern = re.compile(name.replace("*", ".*") + "$")
        assert any(pattern.match(s) for s in listed), f"reproduce.sh has no section {name}"


VLLM_ENDPOINTS = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}  # vLLM's, in the guide's hot-load loop


def test_serving_guide_names_only_real_endpoints():
    routes = set(re.findall(r'@app\.(?:get|post)\("([^"]+)"', (ROOT / "src/forgetless/serve/app.py").read_text()))
    named = set(re.findall(r"(/v1/\w+(?:/\w+)*)", (ROOT / "docs/serving.md").read_text())) - VLLM_ENDPOINTS
    assert named and named <= routes, named - routes
    assert routes - {"/"} <= named, f"endpoints the guide does not describe: {routes - {'/'} - named}"


def anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


RESULTS = ["docs/RESULTS.md", *sorted(f"docs/results/{p.name}" for p in (ROOT / "docs" / "results").glob("*.md"))]


@pytest.mark.parametrize("doc", ["README.md", *RESULTS, "docs/DESIGN.md", *GUIDES, "docs/api.md"])
def test_links_to_sections_and_files_resolve(doc):
    """Every [text](#anchor), [text](FILE#anchor) and relative file link of a doc points at something that exists."""
    path = ROOT / doc
    broken = []
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", path.read_text(), flags=re.S)  # no links in code
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md":
            text = re.sub(r"^```.*?^```", "", linked.read_text(), flags=re.S | re.M)
            headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
            if fragment not in {anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{doc}: links to nothing: {broken}"
