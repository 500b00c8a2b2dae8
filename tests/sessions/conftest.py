"""The tiny-model helpers live in kakeya_runtime.server.testing, which imports the generated stubs."""

from kakeya_runtime import protogen

protogen.ensure()
