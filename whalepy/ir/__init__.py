"""The data model: the values passed between whalepy's steps (enums, plan, profile, the rules of
what the runtime lowers). Imports nothing above it, and no torch at import."""
