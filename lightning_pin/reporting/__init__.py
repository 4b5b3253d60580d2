"""Reading what runs leave behind: reports (JSON/PNG), tables, checkpoint diffs. Reads files;
imports neither the engine nor Lightning."""

__all__ = []
