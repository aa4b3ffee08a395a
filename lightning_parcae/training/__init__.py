"""Lightning integration pieces shared by both Lightning namespaces: namespaces, the launcher's environment and
the model layouts the pipeline can cut."""
