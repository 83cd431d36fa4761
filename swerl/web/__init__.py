"""The browser views of swerl: `swerl inspect` (trajectories of a finished run, token by token)
and `swerl dashboard` (the live fleet), one small aiohttp app each, rendered with Jinja2."""
