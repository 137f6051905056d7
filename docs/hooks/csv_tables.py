"""Benchmark tables and plots in the docs come from the committed files in bench/results/, so a
page quotes no number that is not in a named file. In a page,

    <!-- csv-table file=bench/results/X.csv columns=V,provider,ms,x_floor op=fwd+bwd provider!=a,b -->
    (the table)
    <!-- /csv-table -->

holds a table of those columns over the rows that pass the filters (col=v1,v2 keeps rows whose
col is one of the values; col!=v1,v2 drops them), in file order or by sort=col1,col2 (stable,
numbers as numbers), followed by a line naming the file and, where the CSV has them, its GPU,
date and commit; and

    <!-- results-image file=bench/results/X.png alt=text -->
    ![text](../bench/results/X.png)
    <!-- /results-image -->

embeds a committed plot (copied into the site as results/X.png). The blocks are written into
the pages, so they read the same on the repository's web view; the site build (mkdocs hook)
renders each again from its file and fails when a page differs, or names a missing file,
column, or no row. After a new run or a new marker:

    python docs/hooks/csv_tables.py        # rewrites every block in docs/*.md from its file
"""
import csv
import os
import re

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

TABLE = re.compile(r"<!--\s*csv-table\s+(?P<args>.*?)\s*-->\n(?P<body>.*?)<!--\s*/csv-table\s*-->", re.S)
IMAGE = re.compile(r"<!--\s*results-image\s+file=(?P<file>\S+)(?:\s+alt=(?P<alt>.*?))?\s*-->\n"
                   r"(?P<body>.*?)<!--\s*/results-image\s*-->", re.S)
HEADERS = {"ms": "ms", "x_floor": "x floor", "peak_extra_mib": "peak extra MiB", "host_ms": "host ms",
           "ms_step": "ms/step", "tokens_s": "tokens/s", "speedup": "x native", "peak_mib": "peak MiB",
           "fp32_rel_diff": "fp32 loss vs native", "loss_bound_peak_mib": "peak MiB at V 256000",
           "max_micro_batch": "largest micro-batch", "rows": "rows", "provider": "provider",
           "config": "configuration", "x_4gemm": "x 4 GEMMs",
           "peak_minus_grads_mib": "peak - gradients MiB"}


def _fmt(value):
    """Integers as written; 1.08183e-05 -> 1.1e-05; more than three decimals -> three."""
    try:
        x = float(value)
    except ValueError:
        return value
    if re.fullmatch(r"-?\d+", value):
        return value
    if "e" in value.lower():
        return f"{x:.2g}"
    decimals = len(value.split(".")[1]) if "." in value else 0
    return f"{x:.3f}" if decimals > 4 else value


def _key(value):
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def render(args, root, page):
    opts = {}
    for token in args.split():
        m = re.fullmatch(r"([\w.+-]+)(!?=)(.*)", token)
        if not m:
            raise PluginError(f"{page}: csv-table: argument {token!r}: expected name=value or name!=value")
        opts[(m.group(1), m.group(2))] = m.group(3)
    path = opts.pop(("file", "="), None)
    columns = opts.pop(("columns", "="), None)
    sort = opts.pop(("sort", "="), "")
    if not path or not columns:
        raise PluginError(f"{page}: csv-table: needs file= and columns=, got {args!r}")
    full = os.path.join(root, path)
    if not os.path.isfile(full):
        raise PluginError(f"{page}: csv-table: file={path}: not found")
    with open(full, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    columns = columns.split(",")
    have = set(rows[0]) if rows else set()
    for col in columns + [k for k, _ in opts]:
        if col not in have:
            raise PluginError(f"{page}: csv-table: column {col!r} not in {path} (it has {sorted(have)})")
    for (col, op), values in opts.items():
        values = values.split(",")
        rows = [r for r in rows if (r[col] in values) == (op == "=")]
    for col in reversed([c for c in sort.split(",") if c]):
        if col not in have:
            raise PluginError(f"{page}: csv-table: sort column {col!r} not in {path}")
        rows.sort(key=lambda r: _key(r[col]))  # stable: file order within equal keys
    if not rows:
        raise PluginError(f"{page}: csv-table: no row of {path} passes the filters {args!r}")
    out = ["| " + " | ".join(HEADERS.get(c, c) for c in columns) + " |",
           "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rows]
    where = [rows[0][k] for k in ("gpu", "date", "commit") if rows[0].get(k)]
    out += ["", f"*From `{path}`" + (f" ({', '.join(where)})" if where else "") + ".*"]
    return "\n".join(out)


def _image_link(m, page_path, root):
    """The image as the page in the repository shows it (a path relative to the page)."""
    rel = os.path.relpath(os.path.join(root, m.group("file")), os.path.dirname(page_path))
    return f"![{m.group('alt') or os.path.basename(m.group('file'))}]({rel})"


def regenerate(text, page_path, root):
    """The page with every block rendered again from its file."""
    def table(m):
        return f"<!-- csv-table {m.group('args')} -->\n{render(m.group('args'), root, page_path)}\n<!-- /csv-table -->"

    def image(m):
        if not os.path.isfile(os.path.join(root, m.group("file"))):
            raise PluginError(f"{page_path}: results-image: file={m.group('file')}: not found")
        head = m.group(0)[:m.group(0).index("-->") + 3]
        return f"{head}\n{_image_link(m, page_path, root)}\n<!-- /results-image -->"

    return IMAGE.sub(image, TABLE.sub(table, text))


def on_files(files, config):
    """The plots the pages embed, copied from bench/results/ into the site."""
    root = os.path.dirname(config["config_file_path"])
    wanted = set()
    for f in files.documentation_pages():
        if f.abs_src_path and os.path.isfile(f.abs_src_path):
            with open(f.abs_src_path, encoding="utf-8") as page:
                wanted.update(m.group("file") for m in IMAGE.finditer(page.read()))
    for path in sorted(wanted):
        full = os.path.join(root, path)
        if not os.path.isfile(full):
            raise PluginError(f"results-image: file={path}: not found")
        with open(full, "rb") as image:
            files.append(File.generated(config, "results/" + os.path.basename(path), content=image.read()))
    return files


def on_page_markdown(markdown, page, config, files):
    root = os.path.dirname(config["config_file_path"])
    page_path = os.path.join(config["docs_dir"], page.file.src_uri)
    if regenerate(markdown, page_path, root) != markdown:
        raise PluginError(f"{page.file.src_uri}: a table or plot differs from its file in bench/results/; "
                          "run `python docs/hooks/csv_tables.py` to render them again")
    depth = page.file.src_uri.count("/")
    return IMAGE.sub(lambda m: m.group(0).replace(
        _image_link(m, page_path, root),
        f"![{m.group('alt') or ''}]({'../' * depth}results/{os.path.basename(m.group('file'))})"), markdown)


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    for folder, _, names in os.walk(os.path.join(root, "docs")):
        for name in sorted(n for n in names if n.endswith(".md")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            new = regenerate(text, path, root)
            if new != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
                print(f"rendered again: {os.path.relpath(path, root)}")
