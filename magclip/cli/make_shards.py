"""Convert a folder of images + a caption table into webdataset shards for `build_clip_loader`.

    python tools/make_shards.py data/pets/images data/pets/captions.csv data/pets/shards --shard-size 1000
    python tools/make_shards.py imgs/ captions.jsonl out/ --file-column image --caption-column text \
        --prefix train

The table is CSV/TSV with a header or JSONL, one row per (image, caption); file paths are
relative to the images folder. Prints the shard pattern to pass as training data and the rows
it skipped, by reason.
"""

import argparse
import logging

from magclip.cli import as_command
from magclip.data.convert import convert_to_shards


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images_dir", help="folder the table's file paths are relative to")
    parser.add_argument("captions_file", help=".csv, .tsv or .jsonl with a file and a caption per row")
    parser.add_argument("out_dir", help="where the shards and sizes.json go")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    parser.add_argument("--prefix", default="shard", help="shard name prefix")
    parser.add_argument("--file-column", default="file", help="column/key of the image path")
    parser.add_argument("--caption-column", default="caption", help="column/key of the caption")
    parser.add_argument("--no-verify", action="store_true", help="don't decode images to check them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    convert_to_shards(args.images_dir, args.captions_file, args.out_dir, args.shard_size, args.prefix,
                      file_column=args.file_column, caption_column=args.caption_column,
                      verify=not args.no_verify)


console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
