"""Text from outside (a file name, a URL, a server's answer) as the terminal shows it: plain, its control characters
escaped."""
from __future__ import annotations

# C0 and C1 control characters and DEL, shown escaped: a name holding an escape sequence or a line break (a file
# name, a URL, a server's answer quoted in a message) cannot recolour the terminal or print lines of its own.
_SHOWN_ESCAPED = {code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_SHOWN_ESCAPED.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


_SHOWN_ESCAPED_BUT_LINE_FEEDS = {code: shown for code, shown in _SHOWN_ESCAPED.items() if code != ord("\n")}


def one_terminal_line(text: str) -> str:
    """`text` with every control character escaped, so that it shows as one line of plain text."""
    return text.translate(_SHOWN_ESCAPED)


def plain_terminal_lines(text: str) -> str:
    """`text` with every control character but its line feeds escaped (a notice may hold a table)."""
    return text.translate(_SHOWN_ESCAPED_BUT_LINE_FEEDS)


def holds_control_character(text: str) -> bool:
    return any(ord(character) in _SHOWN_ESCAPED for character in text)
