"""The console's pages at /ui: static files shipped in the package (tracetrain/proxy/console/), no
build step and nothing fetched at run time. They read only the documented JSON API, with the key the
login page keeps in a cookie."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

CONSOLE_DIR = Path(__file__).with_name("console")


def mount_console(app: FastAPI, path: str = "/ui") -> None:
    app.mount(path, StaticFiles(directory=CONSOLE_DIR, html=True), name="console")
