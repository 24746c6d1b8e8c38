"""The third stage: a compiled scenario run twice, fault-free and faulted (``batch``), on the engines a
chaos run shares (``bench``), on a local Ray cluster where it declares one (``clustered``, ``cluster``,
``netns``), with what each run left recorded (``outcome``, ``ledger``, ``endpoints``)."""
