"""Typed user-facing errors: each says what is wrong and what to do next, on one line.

They are raised anywhere below the CLI and caught once at the CLI edge (`cli/app.py`), which prints
them without a traceback (`--debug` shows it)."""


def first_line(error: Exception) -> str:
    """An error's message for a one-line report: its first line, at most 200 characters ("no message" where empty)."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else "no message"


class SpecdecError(Exception):
    """A failure the user can fix. `hint` says how."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message} — {self.hint}" if self.hint else self.message


class ModelNotFoundError(SpecdecError):
    """A model name that resolves to nothing: not a profile, folder, file, demo name or reachable hub id."""


class ModelLoadError(SpecdecError):
    """A model that exists but cannot be loaded as asked (format, dtype, quantisation, device)."""


class MissingExtraError(SpecdecError):
    """An optional dependency is not installed; the hint names the extra to install."""


class IncompatibleModelsError(SpecdecError):
    """Target and draft cannot be paired (different tokenizers, special tokens)."""


class InsufficientMemoryError(SpecdecError):
    """The models' weights will not fit in the free memory of the chosen device."""


class DeviceError(SpecdecError):
    """A device or dtype that this machine does not have (e.g. cuda on a CPU-only machine)."""


class ProfileError(SpecdecError):
    """An unknown or malformed profile."""


class InputError(SpecdecError):
    """A bad input file or option value."""


class OutputWriteError(SpecdecError):
    """OUTPUT could not be written (disk full, I/O error); the records before it are intact."""


class OutputClosed(OutputWriteError):
    """Standard output's reader went away (`run -o - | head`): the run stops quietly, as a pipe's writer does."""


class CacheWriteError(SpecdecError):
    """The specdec home could not be written (a full disk, a read-only folder); nothing half-written is left."""


class ChatTemplateError(InputError):
    """Messages a model's own chat template refuses (its raise_exception: Gemma's has no system role, for one)."""


class PromptTooLongError(InputError):
    """A prompt that leaves no room in the model's context for even one new token."""

    def __init__(self, prompt_tokens: int, context: int, hint: str = "") -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens but the model takes at most {context} (prompt and reply together)",
            hint or f"shorten the prompt to fewer than {context} tokens, or use a model with a longer context",
        )
        self.prompt_tokens = prompt_tokens
        self.context = context
