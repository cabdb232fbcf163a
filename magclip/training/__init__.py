"""The training layer: the accelerate engine, the one run skeleton, and one task per modality."""
