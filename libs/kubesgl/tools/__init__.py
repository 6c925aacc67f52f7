"""Developer tools that check the code base itself (`python -m kubesgl.tools.imports`)."""
