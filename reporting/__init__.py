"""The parts of report.py's paired report, one section each (report.py's docstring lists them)."""
