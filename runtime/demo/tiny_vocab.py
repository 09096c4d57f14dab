"""The tiny models' vocabulary: Tekken-style special tokens, then the 256 byte symbols (runtime/demo/tiny.py)."""

# Tekken-style special tokens: <s> = 1, </s> = 2, [IMG] = 10, <pad> = 11, as in Ministral-3B.
SPECIAL_TOKENS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
]
BOS_ID, EOS_ID, PAD_ID = 1, 2, 11
