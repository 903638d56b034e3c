"""Built-in tasks. Each generates its own prompt/completion rows and ships its reward."""
