"""mkdocs hook: the repository's CHANGELOG.md and CONTRIBUTING.md as pages of the site
(changelog.md, contributing.md), so each text lives in one file."""
import os

from mkdocs.structure.files import File

PAGES = {"changelog.md": "CHANGELOG.md", "contributing.md": "CONTRIBUTING.md"}


def on_files(files, config):
    root = os.path.dirname(config["config_file_path"])
    for page, source in PAGES.items():
        with open(os.path.join(root, source), encoding="utf-8") as f:
            files.append(File.generated(config, page, content=f.read()))
    return files
