"""An image inside an HTML page: the reports (``compare``'s, ``inspect``'s) are single files that can be
mailed or attached to a CI run without the PNGs beside them."""
from __future__ import annotations

import base64
import html


def inline_png(png: bytes, alt: str) -> str:
    """An ``<img>`` holding ``png`` itself, as a base64 data URI."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
