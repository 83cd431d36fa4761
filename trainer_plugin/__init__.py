"""swerl's slime plugin (imported as `swerl.trainer_plugin`): the hooks slime loads by dotted path.

Nothing from slime is imported at module import time. The hooks themselves arrive with the
trainer-plugin issue; this package exists so the layout and packaging are in place.
"""
