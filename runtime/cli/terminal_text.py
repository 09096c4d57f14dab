"""Text from outside (a file name, a URL, a server's answer) as the terminal shows it: plain, its control characters
escaped."""
from __future__ import annotations

from typing import Optional

# C0 and C1 control characters, DEL and direction controls, shown escaped: a name holding an escape sequence or a
# line break (a file name, a URL, a server's answer quoted in a message) cannot recolour the terminal, print lines of
# its own or turn the rest of its line around.
_SHOWN_ESCAPED = {code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_SHOWN_ESCAPED.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
# Unicode's direction marks and overrides, which make a terminal show the rest of a line in another order.
_SHOWN_ESCAPED.update({code: f"\\u{code:04x}" for code in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
                                                           *range(0x2066, 0x206A))})

# A path's bytes that are not UTF-8 reach Python as lone surrogates (os.fsdecode's surrogateescape: byte 0xff is
# U+DCFF), which no UTF-8 stream can write: shown as the bytes they stand for; any other lone surrogate by its code.
_SHOWN_ESCAPED.update({code: f"\\x{code - 0xDC00:02x}" for code in range(0xDC80, 0xDD00)})
_SHOWN_ESCAPED.update({code: f"\\u{code:04x}" for code in (*range(0xD800, 0xDC80), *range(0xDD00, 0xE000))})

_SHOWN_ESCAPED_BUT_LINE_FEEDS = {code: shown for code, shown in _SHOWN_ESCAPED.items() if code != ord("\n")}


def one_terminal_line(text: str) -> str:
    """`text` with every control character escaped, so that it shows as one line of plain text."""
    return text.translate(_SHOWN_ESCAPED)


def plain_terminal_lines(text: str) -> str:
    """`text` with every control character but its line feeds escaped (a notice may hold a table)."""
    return text.translate(_SHOWN_ESCAPED_BUT_LINE_FEEDS)


def holds_control_character(text: str) -> bool:
    return any(ord(character) in _SHOWN_ESCAPED and not _lone_surrogate(character) for character in text)


def undecodable_byte(text: str) -> Optional[str]:
    """The first byte of a path given on the command line that is not UTF-8 text, as `\\xff`; None where all is."""
    return next((_SHOWN_ESCAPED[ord(character)] for character in text if _lone_surrogate(character)), None)


def _lone_surrogate(character: str) -> bool:
    return 0xD800 <= ord(character) < 0xE000
