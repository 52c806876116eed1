"""The guide's evidence from a study: reads STUDY_FOLDER/results.json (`forgetless study standard`) and writes the
part of it the guide reads, with its provenance, to src/forgetless/guide_study.json (forgetless.guide.STUDY); then
`python scripts/sync_docs.py` rewrites the README's and docs/methods.md's guide from it. The study folder stays
out of git; its finished arms' records are kept in docs/results/study-standard/ (scripts/study-standard.sh save).

    python scripts/guide_evidence.py ~/forgetless-study/standard --section real-models.md#ANCHOR \\
        --study-command "bash scripts/study-standard.sh"

--section is the study's section of the results, PAGE.md#ANCHOR with PAGE a page of docs/results/ (each generated
row links to it); --machine defaults to the machines the study's arms ran on (each arm records its own)."""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main(argv: list[str]) -> int:
    from forgetless.config import git_commit
    from forgetless.guide import RESULTS, STUDY, summary
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the study's --out folder (it holds results.json)")
    parser.add_argument("--section", required=True, help="the study's section of the results: PAGE.md#ANCHOR, PAGE a "
                        "page of docs/results/")
    parser.add_argument("--study-command", required=True, help="the command that ran the study")
    parser.add_argument("--machine", default=None, help="where the study ran [default: the machines its arms name]")
    parser.add_argument("--out", type=Path, default=STUDY, help=f"where to write [default: {STUDY.relative_to(ROOT)}]")
    args = parser.parse_args(argv)
    if not (args.folder / "results.json").is_file():
        parser.error(f"{args.folder} holds no results.json: give the study's --out folder once it has finished")
    page, _, anchor = args.section.partition("#")
    if not anchor or not (ROOT / RESULTS / page).is_file():
        parser.error(f"--section {args.section}: give PAGE.md#ANCHOR with PAGE a page of {RESULTS}/ "
                     "(e.g. real-models.md#the-sections-anchor)")
    results = json.loads((args.folder / "results.json").read_text())
    if "study" not in results:
        parser.error(f"{args.folder / 'results.json'} is not a study's (no 'study' key): give a `forgetless study` "
                     "folder")
    machine = args.machine or "; ".join(results["study"].get("machines", ["not recorded"]))
    made = {"command": "python scripts/guide_evidence.py " + " ".join(argv), "commit": git_commit(),
            "machine": machine, "date": datetime.date.today().isoformat(), "section": args.section}
    args.out.write_text(json.dumps(summary(results, args.study_command, made), indent=1) + "\n")
    print(f"wrote {args.out}; now run python scripts/sync_docs.py")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
