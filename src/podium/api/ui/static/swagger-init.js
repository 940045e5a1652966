// Starts the vendored Swagger UI on this server's own OpenAPI document. validatorUrl is null so the
// page never asks validator.swagger.io (another host) for a badge.
window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  validatorUrl: null,
  deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
});
