// The object that builds tests/pch.h's precompiled header (FARMEM_PCH); every test reuses it.
