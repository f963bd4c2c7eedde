"""`specdec chat`: the conversation state (no Rich) and the interactive loop that prints it."""

from specdec_cli.chat.conversation import Conversation
from specdec_cli.chat.loop import Screen, run_chat

__all__ = ["Conversation", "Screen", "run_chat"]
