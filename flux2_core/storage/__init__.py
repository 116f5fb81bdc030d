"""Weight storage: the protocol every storage class of a model's layers answers (``protocol.py``)."""
