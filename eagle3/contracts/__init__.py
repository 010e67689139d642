"""One module per stage output: the only code that reads or writes that format."""
