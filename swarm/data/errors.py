"""The single exception type of the data layer."""

from __future__ import annotations


class DataError(Exception):
    """Bad input to the data layer: a missing tokenizer, a corrupt shard, a bad input line, ...

    The message is always one line and names the offending file or field, so that callers can
    print it as ``error: <message>`` and exit with status 2 instead of showing a traceback::

        try:
            dataset = TokenDataset.open(path)
        except DataError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    """

    def __init__(self, message: str) -> None:
        # Messages often embed third-party error text (JSON decoder, pyarrow, numpy) that can
        # span several lines; fold them so the CLI contract "one error line" always holds.
        one_line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
        super().__init__(one_line)
