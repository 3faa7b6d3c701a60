"""The Gradio playground (``playground``): a run observed step by step (``live``), what each poll of the
page is sent (``views``) and the page itself (``page``)."""
