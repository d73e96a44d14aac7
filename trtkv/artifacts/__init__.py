"""What ``trtkv build`` and ``trtkv calibrate`` write and ``Engine.load`` reads: the engine directory's typed
manifest (``manifest.py``, ``engine_dir.py``) and the calibration artifact (``calibration.py``). Records and
their validators only: nothing here builds, measures or runs a model."""
