"""``generate_many`` and its parts: the arguments (``arguments``), whole batches (``batches``), the refill
(``scheduler``) and the call itself (``generation``)."""

from .generation import Generation, generate_many

__all__ = ["Generation", "generate_many"]
