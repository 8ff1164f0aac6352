"""Named errors of reading a checkpoint's tokenizer files. Messages name the files, lines and ids involved."""


class TokenizerLoadError(Exception):
    """Tokenizer files are missing, malformed, or in a format that is refused."""


class MissingTokenizer(TokenizerLoadError):
    """Text was asked of a checkpoint without tokenizer files; the message names the files and what needed them."""
