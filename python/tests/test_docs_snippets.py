"""The README's Python snippets, and the documentation's marked `<!-- test: run -->`, run as a
reader would paste them (CPU), each in a fresh interpreter, so they cannot rot. A snippet that
needs megatron-core skips where it is not installed."""
import importlib.util
import os
import re
import socket
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
MARK = "<!-- test: run -->"


def _snippets():
    """(id, code): every python block of README.md; in docs/, the blocks right after MARK."""
    found = []
    readme = os.path.join(REPO, "README.md")
    if os.path.exists(readme):
        with open(readme) as f:
            text = f.read()
        found += [(f"README.md#{i}", m.group(1)) for i, m in enumerate(FENCE.finditer(text))]
    docs = os.path.join(REPO, "docs")
    for folder, _, names in sorted(os.walk(docs)):
        for name in sorted(n for n in names if n.endswith(".md")):
            path = os.path.join(folder, name)
            with open(path) as f:
                text = f.read()
            rel = os.path.relpath(path, REPO)
            for i, m in enumerate(FENCE.finditer(text)):
                if text[:m.start()].rstrip().endswith(MARK):
                    found.append((f"{rel}#{i}", m.group(1)))
    return found


SNIPPETS = _snippets()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_the_readme_has_python_snippets():
    if not os.path.exists(os.path.join(REPO, "README.md")):
        pytest.skip("not run from the repository (no README.md beside python/)")
    assert any(name.startswith("README.md") for name, _ in SNIPPETS)
    assert any(name.startswith("docs/") for name, _ in SNIPPETS)


@pytest.mark.parametrize("name,code", SNIPPETS, ids=[name for name, _ in SNIPPETS])
def test_snippet_runs(name, code, tmp_path):
    if "megatron" in code and importlib.util.find_spec("megatron") is None:  # (a missing parent
        # package makes find_spec("megatron.core") raise)
        pytest.skip("megatron-core is not installed")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port(),
               PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"{name} failed:\n{code}\n--- output ---\n{out.stdout}\n{out.stderr[-4000:]}"


def test_readme_links_and_first_commands():
    """The README's relative links name files that exist (docs/ pages included: the site's own
    links are checked by mkdocs --strict), and its first code block is the two commands."""
    readme = os.path.join(REPO, "README.md")
    if not os.path.exists(readme):
        pytest.skip("not run from the repository (no README.md beside python/)")
    with open(readme) as f:
        text = f.read()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    missing = [link for link in links if not re.match(r"[a-z]+://", link)
               and not os.path.exists(os.path.join(REPO, link.split("#")[0]))]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    first = re.search(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    assert first.group(1) == "bash" and "launch/quickstart.sh" in first.group(2) \
        and "launch/test.sh" in first.group(2), first.group(0)
