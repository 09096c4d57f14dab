"""What the prompt enhancer (PE) is asked: the user message and the chat template around it.

The PE is trained on one conversation shape: the fixed system text inside its chat template, then one user
message holding `{"prompt", "width", "height"}` as JSON. The answer is the revised prompt.

Baidu ships the template as `pe_tokenizer/chat_template.jinja`; ComfyUI's single file carries no template,
so `ERNIE_PE_CHAT_TEMPLATE` rebuilds Baidu's from public copies (ComfyUI's official ERNIE workflow renders the
same string: `<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]{json}[/INST]`).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from ..core.errors import InvalidInputError, ModelFileError

ERNIE_PE_SYSTEM_TEXT = (
    "你是一个专业的文生图 Prompt 增强助手。你将收到用户的简短图片描述及目标生成分辨率，请据此扩写为一段内容丰富、"
    "细节充分的视觉描述，以帮助文生图模型生成高质量的图片。仅输出增强后的描述，不要包含任何解释或前缀。"
)

ERNIE_PE_CHAT_TEMPLATE = (
    "{{- bos_token }}[SYSTEM_PROMPT]" + ERNIE_PE_SYSTEM_TEXT + "[/SYSTEM_PROMPT]\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'user' %}\n"
    "{{- '[INST]' + message['content'] + '[/INST]' }}\n"
    "{%- elif message['role'] == 'assistant' %}\n"
    "{{- message['content'] }}{{ eos_token }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
)


def user_message(prompt: str, width: int, height: int) -> str:
    """The PE's user turn, byte for byte as diffusers and Baidu build it."""
    if not isinstance(prompt, str):
        raise InvalidInputError(f"the prompt must be text, got {type(prompt).__name__}")
    return json.dumps({"prompt": prompt, "width": int(width), "height": int(height)}, ensure_ascii=False)


def chat_messages(prompt: str, width: int, height: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": user_message(prompt, width, height)}]


def render_chat(tokenizer: Any, prompt: str, width: int, height: int, chat_template: Optional[str] = None) -> str:
    """The full PE input text. Uses the tokenizer's own template unless it has none (then Baidu's).

    `add_generation_prompt=False` as in diffusers: the template's user turn already ends where the answer starts.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None) or ERNIE_PE_CHAT_TEMPLATE
    messages = chat_messages(prompt, width, height)
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=False)
    except MemoryError:
        raise
    except Exception as error:  # the template is code the tokenizer's folder brings: jinja2 raises what it may
        raise unusable_template(tokenizer, error) from None


def unusable_template(tokenizer: Any, error: BaseException) -> ModelFileError:
    """A chat template that does not render, as one line naming the tokenizer it came with."""
    from ..formats.tokenizer_fit import origin_of

    reason = " ".join(str(error).split())[:160] or "it gave no reason"
    line = getattr(error, "lineno", None)
    where = f" at line {line}" if isinstance(line, int) else ""
    origin = origin_of(tokenizer)
    return ModelFileError(f"the chat template of {origin.shown} cannot be rendered ({reason}{where}): "
                          f"{origin.fix.format(part='prompt enhancer')}").naming(*origin.settings)


def prompt_token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of the rendered chat text. The template writes BOS itself, so the tokenizer must not add another.

    (diffusers tokenises with the tokenizer's defaults; with a tokenizer that adds BOS on its own that feeds the
    PE `<s><s>`, which no serving stack does. Here exactly one BOS starts the input whatever the tokenizer does.)
    """
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids
