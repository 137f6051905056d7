"""mkdocs hook: a reference page per public C++ header (include/fusedloss/*.h), generated at
build time: the header's own summary comment, the functions, types and constants it declares,
and the header itself (declarations with their comments); reference/cpp.md lists them where it
says <!-- cpp-headers -->."""
import os
import re

from mkdocs.structure.files import File

HEADERS = os.path.join("include", "fusedloss")
OUT = "reference/cpp"
MARKER = "<!-- cpp-headers -->"
ONLY_WHEN_BUILT = {"comm_nccl.h": "NCCL", "comm_mpi.h": "MPI", "nccl_bootstrap.h": "both NCCL and MPI"}

_DECL = re.compile(
    r"^(?:inline\s+|constexpr\s+|static\s+)*(?P<kind>struct|class|enum class|enum|using)\s+(?P<name>\w+)"
    r"|^(?:[\w:<>,*&\s]+?)\b(?P<func>\w+)\s*\((?![^)]*\)\s*;\s*//\s*private)", re.M)
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "static_assert", "defined"}


def summary(text):
    """The first paragraph of the header's leading comment, as prose (without the "fusedloss: " it starts with)."""
    lines = []
    for line in text.splitlines():
        if line.startswith("//") and line[2:].strip():
            lines.append(line[2:].strip())
        elif line.strip() or lines:
            break  # the first paragraph of the leading comment
    return re.sub(r"^fusedloss:\s*", "", " ".join(lines))


def declarations(text):
    """Top-level names declared in namespace fusedloss: (kind, name), in order, once each."""
    body = re.sub(r"//[^\n]*", "", text)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    seen, out = set(), []
    depth = 0
    for line in body.splitlines():
        stripped = line.strip()
        # only lines at namespace level (depth 1: inside namespace fusedloss { ... })
        if depth <= 1 and stripped and not stripped.startswith("#"):
            m = _DECL.match(stripped)
            if m:
                kind = m.group("kind") or "function"
                name = m.group("name") or m.group("func")
                if name and name not in _KEYWORDS and name != "fusedloss" and (kind, name) not in seen:
                    seen.add((kind, name))
                    out.append((kind, name))
        depth += line.count("{") - line.count("}")
    return out


def page(name, text):
    decls = declarations(text)
    groups = {}
    for kind, decl in decls:
        groups.setdefault({"function": "Functions", "using": "Type aliases"}.get(kind, "Types"), []).append(decl)
    md = [f"# `fusedloss/{name}`", "", summary(text) or "", "",
          f"```cpp\n#include <fusedloss/{name}>\n```", ""]
    if name in ONLY_WHEN_BUILT:
        md += ['!!! note "Installed only with its communicator"',
               f"    A build installs this header only when its library has {ONLY_WHEN_BUILT[name]} "
               "(`python -m fusedloss --info` says what a build has); the wheel has neither NCCL nor "
               "MPI. See [Install](../../install.md#the-c-sdk).", ""]
    for title in ("Types", "Type aliases", "Functions"):
        if title in groups:
            md += [f"**{title}:** " + ", ".join(f"`{d}`" for d in groups[title]), ""]
    md += ["## The header", "", f"`include/fusedloss/{name}`, as installed:", "", "```cpp", text.rstrip(), "```", ""]
    return "\n".join(md)


def _headers(config):
    root = os.path.dirname(config["config_file_path"])
    folder = os.path.join(root, HEADERS)
    out = []
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".h")):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            out.append((name, name[:-2], f.read()))
    with open(os.path.join(folder, "config.h.in"), encoding="utf-8") as f:
        out.append(("config.h", "config", f.read()))
    return out


def on_files(files, config):
    for name, stem, text in _headers(config):
        files.append(File.generated(config, f"{OUT}/{stem}.md", content=page(name, text)))
    return files


def on_page_markdown(markdown, page, config, files):
    """reference/cpp.md's <!-- cpp-headers --> becomes the table of the headers' pages."""
    if MARKER not in markdown:
        return markdown
    table = ["| header | what it holds |", "|---|---|"]
    for name, stem, text in _headers(config):
        table.append(f"| [`fusedloss/{name}`](cpp/{stem}.md) | {summary(text).replace('|', '/')} |")
    return markdown.replace(MARKER, "\n".join(table))
