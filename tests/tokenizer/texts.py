"""Texts the tokenizer tests share."""

# English, digits, punctuation, Chinese (Han), Japanese kana, accents, emoji (4-byte and with a modifier), newlines,
# runs of spaces and tabs, contractions and a special-token string.
MIXED_TEXT = (
    "Hello, World! It's 2024: the river's 1,234,567 boats SAILED at 09:45.\n\n"
    "你好，世界！今天天气很好。日本語のテキスト。 naïve café ÀÉÎ\t\ttabs   and spaces\r\n"
    "Emoji: 😀🚀 👍🏽 done—“quoted” they'll we'd I'M<|im_end|> tail"
)
