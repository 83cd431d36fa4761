"""The service chassis shared by every swerl server: serving, errors, auth, logging, settings."""
