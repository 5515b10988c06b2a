"""The Anthropic Messages API front end (:mod:`.messages`)."""
