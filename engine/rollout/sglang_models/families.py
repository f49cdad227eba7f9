"""``EntryClass``: SGLang's model classes for the model types of ``engine.models.hf_config`` (SGLang
names its model modules by the same ``model_type``)."""
import importlib

from engine.models.hf_config import MODEL_CLASS_PREFIXES


def _entry_classes() -> list:
    classes = []
    for model_type in MODEL_CLASS_PREFIXES:
        entry = importlib.import_module(f"sglang.srt.models.{model_type}").EntryClass
        classes.extend(entry if isinstance(entry, list) else [entry])
    return classes


EntryClass = _entry_classes()
