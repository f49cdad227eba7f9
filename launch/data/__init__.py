"""Dataset preparation scripts: GSM8K conversion and reasoning-gym generation into the prompt Parquet schema."""
