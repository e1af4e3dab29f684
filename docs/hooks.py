"""mkdocs hook: the performance diary (docs/history/) is kept as it was written, and some of its links point to where
things were then (README sections that moved, ../README.md). In those pages only, a relative link whose target file
is not part of the site is rendered as its plain text, so `mkdocs build --strict` keeps checking every other page's
links. The files themselves are not changed."""
from __future__ import annotations

import posixpath
import re

_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    if not src.startswith("history/"):
        return markdown
    known = {f.src_uri for f in files}

    def fix(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        path = target.split("#", 1)[0]
        if not path or "://" in path or path.startswith("mailto:"):
            return m.group(0)
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(src), path))
        return m.group(0) if resolved in known else text

    return _LINK.sub(fix, markdown)
