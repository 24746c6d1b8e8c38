"""A user's pipeline module that exits while it is imported: validating must report it, not exit."""

import sys

sys.exit("exits_on_import refuses to be imported")
