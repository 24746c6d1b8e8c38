"""A user's pipeline module that raises KeyboardInterrupt while it is imported."""

raise KeyboardInterrupt
