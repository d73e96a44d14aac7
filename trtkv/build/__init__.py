"""`trtkv build` and `trtkv calibrate`: write engine directories, calibrate, select formats."""
