"""Render docs/results.md from docs/results.template.md: every number is looked up in a committed JSON.

    python tools/render_results.py                      # docs/results.template.md -> docs/results.md
    python tools/render_results.py --check              # exit 1 if docs/results.md is not the rendering

Placeholders ({{num FILE KEY}}, {{grid FILE ROW COLUMN}}, {{diff FILE ROW:BASE COLUMN}}, {{include FILE}})
are documented in magclip/experiments/results_page.py. Regenerate the JSON files first (the commands are
in the template).
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from magclip.experiments.results_page import render  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--template", default=str(ROOT / "docs" / "results.template.md"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    text = render(Path(args.template).read_text(), ROOT)
    if args.check:
        same = Path(args.out).is_file() and Path(args.out).read_text() == text
        print(f"{args.out}: {'up to date' if same else 'OUT OF DATE (run tools/render_results.py)'}")
        return 0 if same else 1
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
