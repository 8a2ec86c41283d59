"""A run's settings: one typed, frozen dataclass per config section (`run.RunSettings` and
the sections it holds), each field's default and comment written once; the ConfigDict
config files and flags change (`base.get_config`), made from them and turned back into them
at start-up; and the reference page written from them (`reference`)."""
