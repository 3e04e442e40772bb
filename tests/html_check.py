"""Whether a page would load anything from outside its folder (what "self-contained, opens offline" means for
the reports): the static check the report tests run on every page they build; tests/browser_check.py observes the
same in a real browser where one is installed. A test helper: the library writes only its own escaped markup,
relative links and plotly's inlined bundle, so a check at run time would test the code again, not its input.
"""

from __future__ import annotations

from html.parser import HTMLParser


def external_references(page: str) -> list[str]:
    """Every src/href/srcset/data/poster attribute or CSS url() that points outside the page's folder tree.

    Relative links, fragments and data:/blob: URIs are local; anything with a scheme or starting with `//`
    is not. Text inside scripts (plotly.js mentions URLs it never fetches here) is not an attribute.
    """
    finder = _ReferenceFinder()
    finder.feed(page)
    return [r for r in finder.refs if _is_external(r)]


def _is_external(ref: str) -> bool:
    ref = ref.strip().lower()
    if ref.startswith("//"):
        return True
    scheme = ref.split(":", 1)[0] if ":" in ref else ""
    return bool(scheme) and "/" not in scheme and scheme not in ("data", "blob", "javascript")


class _ReferenceFinder(HTMLParser):
    _ATTRS = ("src", "href", "data", "poster", "action")

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.refs: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._in_style = tag == "style"
        for name, value in attrs:
            if not value:
                continue
            if name == "srcset":  # "url 1x, url 2x"
                self.refs.extend(v.split()[0] for v in value.split(",") if v.strip())
            elif name in self._ATTRS:
                self.refs.append(value)
            elif name == "style":
                self.refs.extend(_css_urls(value))

    def handle_endtag(self, tag: str) -> None:
        if tag == "style":
            self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.refs.extend(_css_urls(data))


def _css_urls(css: str) -> list[str]:
    out, low, i = [], css.lower(), 0
    while (i := low.find("url(", i)) >= 0:
        j = low.find(")", i)
        out.append(css[i + 4: j if j >= 0 else len(css)].strip().strip("'\""))
        i += 4
    if "@import" in low:
        out.extend(part.split(";")[0].strip().strip("'\"") for part in css.split("@import")[1:])
    return out
