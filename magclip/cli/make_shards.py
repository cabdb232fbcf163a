"""Convert a folder of images + a caption table into webdataset shards for `build_clip_loader`.

    python tools/make_shards.py data/pets/images data/pets/captions.csv data/pets/shards --shard-size 1000
    python tools/make_shards.py imgs/ captions.jsonl out/ --image-column image --caption-column text \\
        --prefix train
    python tools/make_shards.py . train.csv shards/ --separator "\\t"   # open_clip's tab-separated .csv
    python tools/make_shards.py imgs/ excel.csv out/ --encoding cp1252 --overwrite
    python tools/make_shards.py train.parquet out/       # a datasets.Image column + a caption column

An image-caption parquet (the hub's CLIP sets: a `datasets.Image` column and `caption`/`title`/`text`)
is converted on its own, two arguments: its images are copied byte for byte, so the shards decode to
the pixels `datasets` decodes (magclip/data/image_parquet.py).

The table is CSV/TSV with a header (read as pandas.read_csv reads it: quoted captions may hold the
separator, quotes and newlines; UTF-8 with or without a BOM) or JSONL, one row per (image, caption);
file paths are relative to the images folder (absolute ones are used as they are; open_clip opens
its `filepath`s relative to the current folder, so pass `.` for its tables). Columns: `file`/`filepath` and
`caption`/`title` (magclip's and open_clip's names) unless --image-column/--caption-column say
otherwise. The separator is sniffed from the header line unless --separator gives it; the log says
which was used. A row with more or fewer fields than the header is skipped as malformed. Prints the
shard pattern to pass as training data and the rows it skipped, by reason, with their line numbers.

The output folder must be new or empty; --overwrite replaces a folder of earlier shards (only one
holding nothing but shards and sizes.json). The new shards are written beside it and swapped in at
the end, so an interrupted run leaves the old shards as they were.
"""

import argparse
import logging
from pathlib import Path

from magclip.cli import as_command
from magclip.data.convert import DEFAULT_ENCODING, convert_to_shards
from magclip.data.image_parquet import convert_image_table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images_dir", help="folder the table's file paths are relative to (or an image-caption "
                                           ".parquet, then followed by out_dir only)")
    parser.add_argument("captions_file", help=".csv, .tsv, .txt or .jsonl with a file and a caption per row")
    parser.add_argument("out_dir", nargs="?", help="where the shards and sizes.json go (a new or empty folder)")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    parser.add_argument("--prefix", default="shard", help="shard name prefix")
    parser.add_argument("--image-column", "--file-column", "--csv-img-key", dest="image_column", default=None,
                        help="column/key of the image path (default: file or filepath, whichever is there)")
    parser.add_argument("--caption-column", "--csv-caption-key", dest="caption_column", default=None,
                        help="column/key of the caption (default: caption or title, whichever is there)")
    parser.add_argument("--separator", "--sep", "--csv-separator", dest="separator", default=None,
                        help='one character, "\\t" or a name (tab, comma, semicolon, pipe); default: sniffed '
                             "from the header line")
    parser.add_argument("--encoding", default=DEFAULT_ENCODING,
                        help="the table's text encoding, e.g. latin-1 or cp1252 (default: UTF-8, BOM or not)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the shards already in out_dir (atomically: old set or new, never a mix)")
    parser.add_argument("--no-verify", action="store_true", help="don't decode images to check them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if Path(args.images_dir).suffix == ".parquet":
        if args.out_dir is not None:
            parser.error(f"{args.images_dir} is an image-caption parquet: give it and the output folder only")
        convert_image_table(args.images_dir, args.captions_file, args.shard_size, args.prefix,
                            image_column=args.image_column, caption_column=args.caption_column,
                            overwrite=args.overwrite)
        return
    if args.out_dir is None:
        parser.error("the following arguments are required: out_dir")
    convert_to_shards(args.images_dir, args.captions_file, args.out_dir, args.shard_size, args.prefix,
                      image_column=args.image_column, caption_column=args.caption_column,
                      separator=args.separator, encoding=args.encoding, overwrite=args.overwrite,
                      verify=not args.no_verify)


console = as_command(main)  # the installed command and the launcher: expected errors in one line

if __name__ == "__main__":
    console()
