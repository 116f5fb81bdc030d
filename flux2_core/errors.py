"""The one error type the engine raises for bad input: a message that says what was wrong and how to fix it."""


class Flux2Error(ValueError):
    """Bad input (weights, prompt, image, size, settings)."""
