"""The run config: every field with its default (`base.get_config`), its start-up checks
(`validate`), its reference page (`reference`) and what a resume may change (`resume_check`)."""
