"""Config schema (`base.get_config`) and its start-up validation (`validate`)."""
