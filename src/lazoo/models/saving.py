"""`ExportsCode`: the `save_pretrained` of lazoo's configs and image processor, which adds the `trust_remote_code`
export (`lazoo.models.export`) to the folder it saves into."""

from __future__ import annotations


class ExportsCode:
    """Mixed in before a transformers config or image processor class: its `save_pretrained` (which a model's
    `save_pretrained`, and so `push_to_hub`, calls for the config) first sets the object's `auto_map` (kept on it,
    as transformers' `register_for_auto_class` does) and writes a flat copy of the code its class needs next to the
    saved files, so the folder loads with `trust_remote_code=True` where lazoo is not installed. A subclass of
    the user's is saved as is (its class is not in the exported code)."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        try:
            from .export import export_for_save
        except ImportError:  # the exported copy itself: transformers' remote-code saving copies its files
            pass
        else:
            export_for_save(self, save_directory)
        return super().save_pretrained(save_directory, *args, **kwargs)
