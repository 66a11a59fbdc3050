"""Exit statuses of ``stability fit`` that other commands read (``stability sweep``)."""

BAD_INPUT = 2  # a clear one-line error about the command line or config
DIVERGED = 3  # the run ended cleanly but diverged: a result, recorded as such, not retried
INTERRUPTED = 143  # stopped by SIGTERM before the run ended (128 + 15, the shell's convention): resumable, not complete
