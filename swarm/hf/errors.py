"""The one exception of the Hugging Face tools."""


class HFError(ValueError):
    """A model directory, checkpoint or tokenizer cannot be converted. The message is one line."""
